#!/usr/bin/env bash
# What offering tools costs a chat request through the OpenAI gateway (tool_choice auto,
# no call made), against the same requests without tools: `roseinfer bench serve
# --endpoint openai-chat [--tools-file]`, the 1B shape, 200 requests at 20 a second.
# The model's tokenizer is GPT-2's with a chat template that lists the tools (a
# Hermes-style system turn), made here; the tools are three of an agent's usual kind.
# Usage: OUT=dir bash docs/bench/tools_cost.sh
source "$(dirname "$0")/bench_env.sh"
tok="$OUT/tok"
python3 - "$tok" <<'PY'
import json, sys
from roseinfer.models.tokenizers import gpt2_tokenizer
out = sys.argv[1]
tok = gpt2_tokenizer(out + "-cache")
tok.chat_template = (
    "{% if tools %}<|im_start|>system\nYou may call these functions, one per "
    "<tool_call></tool_call> block:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
tok.save_pretrained(out)
string = {"type": "string"}
tools = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather and a forecast for a city.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
    {"type": "function", "function": {
        "name": "search_web", "description": "Search the web and return the top results.",
        "parameters": {"type": "object", "required": ["query"], "properties": {
            "query": string, "max_results": {"type": "integer"}}}}},
    {"type": "function", "function": {
        "name": "send_email", "description": "Send an email to one or more recipients.",
        "parameters": {"type": "object", "required": ["to", "subject", "body"], "properties": {
            "to": {"type": "array", "items": string}, "subject": string, "body": string}}}}]
json.dump(tools, open(out + "/tools.json", "w"), indent=1)
PY
prompt="Plan a three day trip to Oslo in spring: where to stay, what to see each day, and what the weather is likely to be."
for t in none tools; do
  extra=$([ $t = tools ] && echo "--tools-file $tok/tools.json")
  python3 -m roseinfer.cli bench serve --model llama3-1b-random --tokenizer "$tok" \
    --dtype bfloat16 --endpoint openai-chat $extra --dataset repeat --prompt "$prompt" \
    --prompt-repeats 8 --num-requests 200 --max-new-tokens 128 --ignore-eos \
    --no-enable-prefix-cache --max-model-len 4096 --request-rate 20 --client-procs 2 \
    --warmup-runs 1 --repeat-runs 1 --no-progress --output-json "$OUT/chat-$t.json" \
    > "$OUT/chat-$t.log" 2>&1 || tail -4 "$OUT/chat-$t.log"
  python3 - "$OUT/chat-$t.json" $t <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["roseinfer"]
s, run = r["summary"], r["runs"][0]
d = lambda k: f"{s[k]['p50']:.3f} / {s[k]['p99']:.3f}"
print(f"{sys.argv[2]}: prompt {run['requests'][0]['prompt_tokens']} tokens, "
      f"{s['output_throughput']:,.0f} tok/s, TTFT {d('ttft_ms')} ms, TPOT {d('tpot_ms')} ms")
PY
done
