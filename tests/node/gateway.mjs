// The gateway driven by the official OpenAI Node package, as a Node user drives it.
//
//   OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=sk-... GATEWAY_MODEL=tiny-echo \
//     node gateway.mjs [chat] [stream] [completions] [models] [errors] [batch]
//
// The SDK reads OPENAI_BASE_URL and OPENAI_API_KEY itself. Each step named (all when none
// is) prints one line of JSON, {"step": name, ...what the SDK returned}; the process exits
// 1 on the first step that throws (its error on stderr). tests/integration/test_gateway_node.py
// runs it against a real worker and gateway and checks each line against the job's stream.

import OpenAI, { toFile } from "openai";

const model = process.env.GATEWAY_MODEL ?? "tiny-echo";
// no retries: each answer is seen as the gateway gave it
const client = new OpenAI({ maxRetries: 0, timeout: 30_000 });

function print(step, result) {
  process.stdout.write(JSON.stringify({ step, ...result }) + "\n");
}

async function chat() {
  const { data, response } = await client.chat.completions
    .create({
      model,
      messages: [{ role: "user", content: "héllo from node 😀" }],
      max_tokens: 12,
    })
    .withResponse();
  const [choice] = data.choices;
  return {
    request_id: response.headers.get("x-request-id"),
    id: data.id,
    object: data.object,
    model: data.model,
    choices: data.choices.length,
    role: choice.message.role,
    content: choice.message.content,
    finish_reason: choice.finish_reason,
    usage: data.usage,
  };
}

async function stream() {
  const chunks = await client.chat.completions.create({
    model,
    messages: [{ role: "user", content: "stream to node" }],
    max_tokens: 20,
    stream: true,
    stream_options: { include_usage: true },
  });
  const seen = [];
  for await (const chunk of chunks) {
    seen.push(chunk);
  }
  const withChoices = seen.filter((c) => c.choices.length > 0);
  const last = seen[seen.length - 1];
  return {
    ids: [...new Set(seen.map((c) => c.id))],
    objects: [...new Set(seen.map((c) => c.object))],
    chunks: seen.length,
    first_role: seen[0].choices[0]?.delta?.role ?? null,
    text: withChoices.map((c) => c.choices[0].delta.content ?? "").join(""),
    finish_reasons: withChoices.map((c) => c.choices[0].finish_reason),
    last_choices: last.choices.length,
    usage: last.usage ?? null,
    usage_chunks: seen.filter((c) => c.usage).length,
  };
}

async function completions() {
  const { data, response } = await client.completions
    .create({ model, prompt: "complete me", max_tokens: 5 })
    .withResponse();
  const streamed = await client.completions.create({
    model,
    prompt: "abc",
    max_tokens: 3,
    stream: true,
  });
  const parts = [];
  for await (const chunk of streamed) {
    parts.push(chunk);
  }
  return {
    request_id: response.headers.get("x-request-id"),
    id: data.id,
    object: data.object,
    text: data.choices[0].text,
    finish_reason: data.choices[0].finish_reason,
    usage: data.usage,
    streamed_id: parts[0].id,
    streamed_text: parts.map((c) => c.choices[0]?.text ?? "").join(""),
    streamed_finish: parts[parts.length - 1].choices[0]?.finish_reason ?? null,
  };
}

async function models() {
  const ids = [];
  for await (const m of client.models.list()) {
    ids.push(m.id);
  }
  const one = await client.models.retrieve(model);
  return { ids, retrieved: one.id, object: one.object };
}

function asError(error) {
  if (!(error instanceof OpenAI.APIError)) {
    throw error;
  }
  return {
    class: error.constructor.name,
    status: error.status,
    code: error.code ?? null,
    type: error.type ?? null,
    message: error.message,
  };
}

async function errors() {
  const result = {};
  const stranger = new OpenAI({ apiKey: "sk-not-a-key", maxRetries: 0 });
  try {
    await stranger.models.list();
    result.wrong_key = null;
  } catch (error) {
    result.wrong_key = asError(error);
  }
  try {
    await client.chat.completions.create({
      model: "gpt-4o",
      messages: [{ role: "user", content: "x" }],
    });
    result.unknown_model = null;
  } catch (error) {
    result.unknown_model = asError(error);
  }
  return result;
}

const TERMINAL = new Set(["completed", "failed", "expired", "cancelled"]);

async function batch() {
  const lines = [0, 1, 2].map((i) => ({
    custom_id: `node-${i}`,
    method: "POST",
    url: "/v1/chat/completions",
    body: { model, messages: [{ role: "user", content: `line ${i} é` }], max_tokens: 4 },
  }));
  const jsonl = lines.map((l) => JSON.stringify(l) + "\n").join("");
  const file = await client.files.create({
    file: await toFile(Buffer.from(jsonl, "utf8"), "node-batch.jsonl"),
    purpose: "batch",
  });
  const created = await client.batches.create({
    input_file_id: file.id,
    endpoint: "/v1/chat/completions",
    completion_window: "24h",
  });
  // poll as a Node user would, with a deadline
  const deadline = Date.now() + 60_000;
  let got = created;
  const statuses = [created.status];
  while (!TERMINAL.has(got.status)) {
    if (Date.now() > deadline) {
      throw new Error(`batch ${created.id} still ${got.status} after 60 s`);
    }
    await new Promise((resolve) => setTimeout(resolve, 100));
    got = await client.batches.retrieve(created.id);
    if (statuses[statuses.length - 1] !== got.status) statuses.push(got.status);
  }
  const output = got.output_file_id
    ? await (await client.files.content(got.output_file_id)).text()
    : "";
  // a second batch, then every batch page by page (the SDK follows `after` itself)
  const second = await client.batches.create({
    input_file_id: file.id,
    endpoint: "/v1/chat/completions",
    completion_window: "24h",
  });
  const listed = [];
  for await (const b of client.batches.list({ limit: 1 })) {
    listed.push(b.id);
    if (listed.length > 10) break;
  }
  const cancelled = await client.batches.cancel(second.id);
  return {
    second_id: second.id,
    listed,
    cancelled_status: cancelled.status,
    file_id: file.id,
    file_bytes: file.bytes,
    sent_bytes: Buffer.byteLength(jsonl, "utf8"),
    purpose: file.purpose,
    batch_id: created.id,
    statuses,
    status: got.status,
    request_counts: got.request_counts,
    output_file_id: got.output_file_id ?? null,
    output: output
      .split("\n")
      .filter((line) => line)
      .map((line) => JSON.parse(line)),
  };
}

const STEPS = { chat, stream, completions, models, errors, batch };
const chosen = process.argv.slice(2);
for (const name of chosen.length ? chosen : Object.keys(STEPS)) {
  const step = STEPS[name];
  if (!step) {
    console.error(`unknown step ${name}: one of ${Object.keys(STEPS).join(", ")}`);
    process.exit(2);
  }
  try {
    print(name, await step());
  } catch (error) {
    console.error(`step ${name} failed:`, error);
    process.exit(1);
  }
}
