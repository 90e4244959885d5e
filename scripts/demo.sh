#!/usr/bin/env bash
# The main job, end to end, on a real chat model (SmolLM2-135M-Instruct, its GGUF as
# shipped, in ../shared/models): start the daemon in the background with an n-gram draft,
# wait for /health, ask a question through the REST endpoint (curl), another through
# `specd chat --once` (streamed over SSE), a JSON-schema answer through the official
# openai client, print the speculation statistics, and stop the daemon. Run after
# scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS=${SPECD_SHARED_MODELS:-../shared/models}
PORT=${SPECD_DEMO_PORT:-8716}
SPECD=.venv/bin/specd
MODEL_FILE="$MODELS/smollm2-135m-instruct/smollm2-135m-instruct-q4_1.gguf"
MODEL=smollm2-135m-instruct-q4_1
URL="http://127.0.0.1:$PORT"

$SPECD start --model "$MODEL_FILE" --draft ngram --port "$PORT"
trap '$SPECD stop --port "$PORT"' EXIT
$SPECD status --port "$PORT"
if command -v curl >/dev/null; then
    echo "--- POST /v1/chat/completions (curl, not streamed) ---"
    curl -s "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
        -d '{"model": "'"$MODEL"'", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 48, "temperature": 0}'
    echo
fi
echo "--- specd chat --once (streamed over SSE) ---"
$SPECD chat --url "$URL" --once "Name the three primary colours." --max-tokens 48 --temperature 0 --stats
echo "--- a JSON-schema answer (official openai client) ---"
.venv/bin/python - "$URL" "$MODEL" <<'EOF'
import json
import sys

import openai

url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
schema = {
    "type": "object",
    "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
    "required": ["country", "capital"],
    "additionalProperties": False,
}
reply = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
    response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},
    max_tokens=64,
    temperature=0,
)
answer = json.loads(reply.choices[0].message.content)
print("answer:", json.dumps(answer))
stats = reply.model_extra.get("specd", {})
print(
    f"speculation: draft {stats.get('draft_kind')} ({stats.get('strategy')}), "
    f"{stats.get('tokens_per_target_pass', 0):.2f} tokens per target pass, "
    f"{stats.get('target_passes')} target passes, "
    f"{stats.get('forced_tokens', 0)} tokens forced by the schema's grammar"
)
# What `--budget auto` chose for this answer's last round, and why: a plain step where it
# predicts trees do not pay (it learns across runs: daemon/learned_store.py); the rounds
# before it may have drawn trees, and tokens the grammar forces come without a pass.
print(f"tree budget, last round: {stats.get('budget_reason')}")
EOF
