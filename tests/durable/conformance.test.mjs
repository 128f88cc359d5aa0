// The Durable Streams server conformance suite against a running daemon
// (tests/test_ds_conformance.py starts it and reads the JSON report).
// DS_BASE_URL: the daemon's Durable Streams prefix; DS_SECRET: a
// credential, sent on every request as the protocol leaves
// authentication to the server (PROTOCOL.md section 12.1).
const secret = process.env.DS_SECRET;
const plainFetch = globalThis.fetch;
globalThis.fetch = (input, init = {}) => {
  const headers = new Headers(init.headers ?? (input instanceof Request ? input.headers : undefined));
  if (secret && !headers.has("authorization")) headers.set("authorization", `Bearer ${secret}`);
  return plainFetch(input, { ...init, headers });
};
// DS_SUITE: the installed suite's module (a file: URL; it resolves vitest
// from where it is installed, the runner's own).
const { runConformanceTests } = await import(process.env.DS_SUITE);
runConformanceTests({
  baseUrl: process.env.DS_BASE_URL,
  longPollTimeoutMs: Number(process.env.DS_LONG_POLL_MS ?? 20000),
});
