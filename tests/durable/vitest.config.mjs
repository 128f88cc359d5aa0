// vitest for tests/durable: the suite's file only, no watch, one file at
// a time (the daemon under test is one process on a small machine).
export default {
  test: {
    include: ["conformance.test.mjs"],
    watch: false,
    fileParallelism: false,
    testTimeout: 30000,
    hookTimeout: 30000,
  },
};
