// vitest for tests/durable: the suite's file only, no watch, one file at
// a time (the daemon under test is one process on a small machine).
// DS_CACHE_DIR: where vite keeps its cache (a test's temp directory).
export default {
  cacheDir: process.env.DS_CACHE_DIR,
  test: {
    include: ["conformance.test.mjs"],
    watch: false,
    fileParallelism: false,
    testTimeout: 30000,
    hookTimeout: 30000,
  },
};
