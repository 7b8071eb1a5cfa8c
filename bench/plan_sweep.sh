#!/usr/bin/env bash
# plan_sweep.sh — the planner's measured table (docs/planner.md, "Measured"): three models (dense
# fp32, bf16 with SwiGLU, MoE), each profiled once and planned with --verify at three budgets
# between its front's smallest and largest peak (20%, 50%, 85% of the way). Prints one markdown
# row per budget: the chosen plan, its measured and predicted peak, its measured step ratio
# against the one the planner stated (the choice timed again against the plain step, Note
# [Confirming the choice] in src/plan/planner.cpp, with its rounds and those of the verify), the
# finalist measurement it was chosen by (Note [Plan finalists]) and the model's prediction, the fastest
# Megatron standard setting that fits (measured in the same rounds), the plain step's median in
# the profile and in the verify rounds (a machine whose speed changed between the two predicts
# worse: Note [Machine speed check] in src/plan/planner.cpp; a reuse of the costs that finds the
# plain step moved by over 10% profiles again), and whether every verified run was bitwise the
# plain run. Needs python3 for the table.
# Usage: [PROFILE_STEPS=5] [VERIFY_STEPS=10] bench/plan_sweep.sh [OUT_DIR]
#   (OUT_DIR default: a new temporary directory; JSON and SVG kept; the step counts are the
#   fewest timed rounds of the profile and of each --verify, which then go on until sure: Note
#   [Rounds until sure] in src/plan/planner.cpp)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
actmem="${ACTMEM_BUILD_DIR:-$root/build}/actmem"
out="${1:-$(mktemp -d)}"
mkdir -p "$out"
common="--num-attention-heads 4 --micro-batch-size 4 --min-offloaded-tensor-size 65536 --fine-grained-offloading-max-inflight-offloads 0"
declare -A model=(
  [dense]="--num-layers 4 --hidden-size 128 --seq-length 256 $common"
  [bf16]="--num-layers 6 --hidden-size 128 --seq-length 128 --swiglu --bf16 $common"
  [moe]="--num-layers 4 --hidden-size 128 --seq-length 128 --num-experts 4 --moe-router-topk 2 $common"
)
for m in dense bf16 moe; do
  echo "plan_sweep: profiling $m" >&2
  # shellcheck disable=SC2086
  "$actmem" plan ${model[$m]} --profile-steps "${PROFILE_STEPS:-5}" --costs "$out/$m-costs.json" \
    --json "$out/$m-front.json" > "$out/$m-front.txt" 2>&1
  for f in 0.2 0.5 0.85; do
    budget=$(python3 -c "import json; fr = json.load(open('$out/$m-front.json'))['front']; \
lo, hi = fr[0]['peak_bytes'], fr[-1]['peak_bytes']; print(int(lo + $f * (hi - lo)))")
    echo "plan_sweep: $m at $budget bytes" >&2
    # shellcheck disable=SC2086
    "$actmem" plan ${model[$m]} --costs "$out/$m-costs.json" --memory-budget "$budget" --verify \
      --verify-steps "${VERIFY_STEPS:-10}" --json "$out/$m-$f.json" --svg "$out/$m-$f.svg" > "$out/$m-$f.txt" 2>&1 ||
      echo "plan_sweep: $m at $f exited $? (see $out/$m-$f.txt)" >&2
  done
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def standard(name, layers):
    return name in ("plain", "selective core_attn", "full uniform 1", "full block 1",
                    "full block %d" % max(1, layers // 2))
mib = lambda b: b / 2**20
print("| model | budget | chosen | peak measured / predicted | step ratio measured / stated "
      "(rounds verify / confirm) | finalist | model "
      "| best standard setting that fits (measured ratio) | plain step profile / verify | all bitwise |")
print("|---|---|---|---|---|---|---|---|---|---|")
for m in ("dense", "bf16", "moe"):
    for f in ("0.2", "0.5", "0.85"):
        try:
            j = json.load(open("%s/%s-%s.json" % (out, m, f)))
        except (OSError, ValueError) as e:
            print("| %s | (%s: %s) |" % (m, f, e)); continue
        budget, runs = j["memory_budget_bytes"], j["verified"]
        chosen = next(r for r in runs if r["strategy"] == j["chosen"]["strategy"])
        fits = [r for r in runs if standard(r["strategy"], j["model"]["num_layers"])
                and r["measured_peak_bytes"] <= budget]
        best = min(fits, key=lambda r: r["measured_step_ratio"]) if fits else None
        worst = max(abs(r["measured_peak_bytes"] - r["predicted_peak_bytes"]) / r["measured_peak_bytes"]
                    for r in runs)
        peak_err = (chosen["predicted_peak_bytes"] / chosen["measured_peak_bytes"] - 1) * 100
        ratio_err = (chosen["planned_step_ratio"] / chosen["measured_step_ratio"] - 1) * 100
        model_err = (chosen["predicted_step_ratio"] / chosen["measured_step_ratio"] - 1) * 100
        fin = chosen.get("finalist_step_ratio")
        fin_text = "%.3f (%+.1f%%)" % (fin, (fin / chosen["measured_step_ratio"] - 1) * 100) if fin else "-"
        print("| %s | %.1f MiB | %s | %.2f / %.2f MiB (%+.2f%%) | %.3f / %.3f (%+.1f%%) (%d / %s) | %s "
              "| %.3f (%+.1f%%) | %s | %.0f / %.0f ms | %s (worst peak error of %d runs %.2f%%) |" % (
                  m, mib(budget), chosen["strategy"], mib(chosen["measured_peak_bytes"]),
                  mib(chosen["predicted_peak_bytes"]), peak_err, chosen["measured_step_ratio"],
                  chosen["planned_step_ratio"], ratio_err, j.get("verify_rounds", 0),
                  j["chosen"].get("confirmed_rounds", "-"), fin_text,
                  chosen["predicted_step_ratio"], model_err,
                  "%s (%.3f)" % (best["strategy"], best["measured_step_ratio"]) if best else "none fits",
                  1e3 * j["profile_plain_step_s"], 1e3 * j["verify_plain_step_s"],
                  "yes" if all(r["bitwise_equal_to_plain"] for r in runs) else "NO", len(runs),
                  100 * worst))
PY
echo "plan_sweep: JSON, SVG and the printed plans in $out" >&2
