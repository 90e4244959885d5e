#!/usr/bin/env bash
# The main job, end to end: start the daemon in the background with the real model pair,
# wait for /health, send one chat request through the REST endpoint (streamed), print the
# answer, and stop the daemon. Run after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS=${SPECD_SHARED_MODELS:-../shared/models}
PORT=${SPECD_DEMO_PORT:-8716}
SPECD=.venv/bin/specd

$SPECD start --model "$MODELS/stories260k" --draft "$MODELS/stories260k-draft" --port "$PORT"
trap '$SPECD stop' EXIT
$SPECD status
if command -v curl >/dev/null; then
    echo "--- POST /v1/chat/completions (curl, not streamed) ---"
    curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
        -d '{"model": "stories260k", "messages": [{"role": "user", "content": "Tell me a story about a dog."}], "max_tokens": 64, "temperature": 0}'
    echo
fi
echo "--- specd chat --once (streamed over SSE) ---"
$SPECD chat --url "http://127.0.0.1:$PORT" --once "Once upon a time" --max-tokens 64
