# Sourced by the tests that compare zeal with its Python peers or need a downloaded model:
# skip_or_fail WHY skips the test (exit 77) — or, under ZEAL_REQUIRE_PEERS=1 (scripts/test sets it
# when CI=true), fails it, so that a cross-check cannot quietly stop running.
skip_or_fail() {
  if [ "${ZEAL_REQUIRE_PEERS:-}" = 1 ]; then
    echo "FAIL: $* (ZEAL_REQUIRE_PEERS=1: the cross-checks must run; scripts/setup installs what they need)"
    exit 1
  fi
  echo "SKIP: $*"
  exit 77
}
