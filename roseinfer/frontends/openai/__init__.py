"""An OpenAI-compatible HTTP gateway in front of the Redis Streams queue."""
