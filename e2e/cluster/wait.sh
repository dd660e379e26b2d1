# Sourced by cluster.sh and e2e/node/node.sh.
# wait_for DESCRIPTION SECONDS COMMAND...: runs COMMAND until it succeeds;
# after SECONDS, says so with the last lines of the logs in $logs (each
# script's own) and fails.
wait_for() {
  local what=$1 secs=$2
  shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      log "timed out after ${secs}s waiting for $what; last log lines:"
      tail -n 30 "$logs"/*.log >&2 || true
      return 1
    fi
    sleep 0.5
  done
}
