#!/usr/bin/env node
// Submit a prompt to roseinfer workers over Redis Streams (protocol v1, docs/protocol.md)
// and print the text as it streams in. Ctrl-C cancels the request.
//
//   npm install && node client.mjs "What is the capital of France?" --max-tokens 64
//
// One request per run, so it reads its one reply stream with its own XREAD. A service
// streaming many requests at once reads all their reply streams with one XREAD over
// every key instead, as the Python clients do (docs/protocol.md, "Connections").
import { parseArgs } from "node:util";
import { createClient, createSentinel, RESP_TYPES } from "redis";
import { decode, encode } from "@msgpack/msgpack";

const USAGE = 'usage: node client.mjs "prompt" [--max-tokens N] [--temperature T (0 = greedy)] ' +
  "[--logprobs K] [--prompt-logprobs K] [--repetition-penalty R] [--logit-bias ID:BIAS ...] " +
  "[--response-format JSON] [--n N] " +
  "[--redis-url URL (redis:// or redis+sentinel://host:port,.../PRIMARY)] [--prefix P] " +
  "[--timeout SECONDS]";
const { values: opts, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    "redis-url": { type: "string", default: process.env.REDIS_URL ?? "redis://127.0.0.1:6379" },
    prefix: { type: "string", default: "roseinfer" },
    "max-tokens": { type: "string", default: "128" },
    temperature: { type: "string", default: "0" },
    logprobs: { type: "string" },
    "prompt-logprobs": { type: "string" },
    "repetition-penalty": { type: "string" },
    "logit-bias": { type: "string", multiple: true },
    "response-format": { type: "string" },
    n: { type: "string", default: "1" },
    timeout: { type: "string", default: "120" },
  },
});
if (positionals.length !== 1) {
  console.error(USAGE);
  process.exit(2);
}

const body = {
  prompt: positionals[0],
  max_tokens: Number(opts["max-tokens"]),
  temperature: Number(opts.temperature), // 0 = greedy
};
// Each chunk then carries one {logprob, top_logprobs, token, top_tokens} per token id.
if (opts.logprobs !== undefined) body.logprobs = Number(opts.logprobs);
// The first chunk then carries one entry per prompt token: null, then {logprob, ...}.
if (opts["prompt-logprobs"] !== undefined) body.prompt_logprobs = Number(opts["prompt-logprobs"]);
if (opts["repetition-penalty"] !== undefined) body.repetition_penalty = Number(opts["repetition-penalty"]);
if (opts["logit-bias"] !== undefined) {
  // Token ids are map keys written as strings, as in JSON.
  body.logit_bias = Object.fromEntries(opts["logit-bias"].map((pair) => {
    const [id, bias] = pair.split(":");
    return [id, Number(bias)];
  }));
}
// The output's shape: '{"type": "json_object"}', a json_schema or a regex (docs/protocol.md).
if (opts["response-format"] !== undefined) body.response_format = JSON.parse(opts["response-format"]);
// n > 1: independent samples, on the one reply stream; each chunk carries its index and
// each sample ends with its own final chunk. Their texts print whole as they end.
const n = Number(opts.n);
if (n !== 1) body.n = n;
const scored = []; // [token id, logprob entry] in order, printed after the text
let promptScored = null; // the first chunk's prompt_logprobs, if asked for

const client = await connect(opts["redis-url"]);
// Reply bodies are binary msgpack: read bulk strings as Buffers, not as UTF-8 text.
const BINARY = { typeMapping: { [RESP_TYPES.BLOB_STRING]: Buffer } };

// No rid field: the entry ID that XADD returns is the request id.
const rid = await client.xAdd(`${opts.prefix}:requests`, "*",
  { v: "1", body: Buffer.from(encode(body)) });

process.on("SIGINT", async () => {
  // The main connection is blocked in XREAD; the abort chunk will end the loop below.
  // (Through Sentinel the client has a second connection to the primary for this.)
  await client.cancel(`${opts.prefix}:cancel`, { rid });
});

const finals = await readReplies(`${opts.prefix}:out:{${rid}}`);
const final = finals[finals.length - 1];
if (n === 1) process.stdout.write("\n");
if (promptScored !== null) process.stdout.write(JSON.stringify({ prompt_logprobs: promptScored }) + "\n");
for (const [tokenId, entry] of scored) {
  process.stdout.write(JSON.stringify({ token_id: tokenId, ...entry }) + "\n");
}
await client.close();
if (final.finish_reason === "error") {
  console.error(`error (${final.error.code}): ${final.error.message}`);
  process.exit(1);
}
const generated = finals.reduce((sum, f) => sum + f.usage.completion_tokens, 0);
const what = n === 1 ? final.finish_reason : `${n} samples`;
console.error(`[${what}: ${final.usage.prompt_tokens} prompt + ${generated} generated tokens]`);

// The final chunks, one per sample (or the error chunk that ends them all).
async function readReplies(key) {
  let lastId = "0-0";
  let nextSeq = 0;
  const finals = [];
  const texts = new Map(); // sample index -> its text so far (n > 1)
  for (;;) {
    const reply = await client.send(
      ["XREAD", "COUNT", "100", "BLOCK", String(Number(opts.timeout) * 1000), "STREAMS", key, lastId],
      BINARY);
    if (reply === null) {
      console.error(`\nno reply within ${opts.timeout}s: is a worker running with prefix ${opts.prefix}?`);
      process.exit(1);
    }
    for (const [id, fields] of reply[0][1]) {
      lastId = id.toString();
      const chunk = decode(fields[fields.findIndex((f) => f.toString() === "body") + 1]);
      if (chunk.seq < nextSeq) continue; // delivery is at-least-once: skip duplicates
      nextSeq = chunk.seq + 1;
      promptScored ??= chunk.prompt_logprobs ?? null;
      (chunk.logprobs ?? []).forEach((entry, i) => scored.push([chunk.token_ids[i], entry]));
      if (n === 1) process.stdout.write(chunk.text);
      else texts.set(chunk.index, (texts.get(chunk.index) ?? "") + chunk.text);
      if (chunk.finish_reason === null) continue;
      finals.push(chunk);
      if (n > 1 && chunk.finish_reason !== "error") {
        process.stdout.write(`--- sample ${chunk.index} (${chunk.finish_reason}) ---\n${texts.get(chunk.index)}\n`);
      }
      if (finals.length === n || chunk.finish_reason === "error") return finals;
    }
  }
}

// A server (redis://) or the primary a Sentinel group names
// (redis+sentinel://[user:pass@]host:port[,host:port...]/PRIMARY[?db=N]), which node-redis
// finds again after a failover. Either way: xAdd, send (a raw command), cancel, close.
async function connect(url) {
  if (!url.startsWith("redis+sentinel://")) {
    const c = await createClient({ url }).connect();
    return {
      xAdd: (...args) => c.xAdd(...args),
      send: (args, options) => c.sendCommand(args, options),
      cancel: async (key, fields) => {
        const other = await c.duplicate().connect(); // the main connection is blocked in XREAD
        await other.xAdd(key, "*", fields);
        await other.quit();
      },
      close: () => c.quit(),
    };
  }
  const rest = url.slice("redis+sentinel://".length);
  const authority = rest.split("/")[0];
  const at = authority.lastIndexOf("@");
  const hosts = authority.slice(at + 1);
  const [username, password] = (at < 0 ? "" : authority.slice(0, at)).split(":");
  const path = new URL("http://host" + rest.slice(authority.length)); // PRIMARY and ?db=N
  const s = await createSentinel({
    name: decodeURIComponent(path.pathname.slice(1)),
    sentinelRootNodes: hosts.split(",").map((h) => {
      const [host, port] = h.split(":");
      return { host, port: Number(port ?? 26379) };
    }),
    masterPoolSize: 2, // one blocked in XREAD, one for the cancel
    nodeClientOptions: {
      username: username ? decodeURIComponent(username) : undefined,
      password: password ? decodeURIComponent(password) : undefined,
      database: Number(path.searchParams.get("db") ?? 0),
    },
  }).connect();
  return {
    xAdd: (...args) => s.xAdd(...args),
    send: (args, options) => s.sendCommand(false, args, options),
    cancel: (key, fields) => s.xAdd(key, "*", fields),
    close: () => s.close(),
  };
}
