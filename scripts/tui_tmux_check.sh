#!/usr/bin/env bash
# Runs `localspec chat` for real inside tmux: types a prompt, sends it, waits for the answer and the
# statistics, stops a second answer with Esc, switches proposer, opens help, quits, and checks the
# history file. Prints the captured screens.
#
#   scripts/tui_tmux_check.sh          scripted fake engine (seconds; history in a temporary home)
#   scripts/tui_tmux_check.sh real     smollm2-135m, float32 (uses your LOCALSPEC_HOME, where its
#                                      converted weights are; the conversation stays in its history)
set -euo pipefail

mode=${1:-fake}
session="localspec-tui-check-$$"
if [[ $mode == fake ]]; then
    export LOCALSPEC_HOME="$(mktemp -d)"
    args=(--fake-engine --model smollm2-135m)
    wait_load=30
else
    args=(--model smollm2-135m --proposer ngram --dtype float32 --max-new-tokens 64)
    wait_load=300
fi
history_dir="$(python -c 'from localspec.base.config import home_dir; print(home_dir() / "history")')"
mkdir -p "$history_dir"
before=$(ls "$history_dir" | wc -l)

cleanup() { tmux kill-session -t "$session" 2>/dev/null || true; }
trap cleanup EXIT

screen() { tmux capture-pane -p -t "$session"; }

wait_for() {  # wait_for REGEX SECONDS: until the pane shows a match
    local deadline=$((SECONDS + $2))
    until screen | grep -qE -- "$1"; do
        if ((SECONDS >= deadline)); then
            echo "FAIL: '$1' did not appear within $2 s; the screen was:" >&2
            screen >&2
            exit 1
        fi
        sleep 0.2
    done
}

tmux new-session -d -s "$session" -x 160 -y 48 "localspec chat ${args[*]}"
wait_for "draft length" "$wait_load"                  # status line: the engine is loaded
echo "== loaded"

tmux send-keys -t "$session" -l "Write a Python function that reverses a string."
tmux send-keys -t "$session" C-j
wait_for "tokens/pass" 120                            # the statistics panel has figures
wait_for "\((eos|max tokens|context limit)\)" 300    # the answer is complete
echo "== first answer"; screen

tmux send-keys -t "$session" -l "And in Rust?"
tmux send-keys -t "$session" C-j
sleep 0.3
tmux send-keys -t "$session" Escape
wait_for "stopped" 30
echo "== second answer stopped with Esc"; screen

tmux send-keys -t "$session" C-r
wait_for "proposer none" 60
echo "== proposer switched to none"

tmux send-keys -t "$session" F1
wait_for "Keys" 10
echo "== help"; screen
tmux send-keys -t "$session" Escape
tmux send-keys -t "$session" C-q
sleep 1

after=$(ls "$history_dir" | wc -l)
if ((after != before + 1)); then
    echo "FAIL: expected one new conversation in $history_dir" >&2
    exit 1
fi
newest="$history_dir/$(ls -t "$history_dir" | head -1)"
python - "$newest" <<'PY'
import json, sys
conv = json.load(open(sys.argv[1]))
roles = [m["role"] for m in conv["messages"]]
assert roles == ["user", "assistant", "user", "assistant"], roles
assert conv["messages"][1]["content"].strip(), "first answer is empty"
assert conv["messages"][3]["stop_reason"] == "stopped", conv["messages"][3]["stop_reason"]
print("== history ok:", sys.argv[1])
PY
echo "PASS ($mode)"
