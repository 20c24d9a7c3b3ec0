# Two trees of the code side by side on the real model, new then old, one run each: $1/new and $1/old hold
# `git archive <rev> worker mlxq schemas producer` of the two revisions. 8 rows on the arms' 8 slots, in
# process, grounded and chat batches alternating, greedy and sampled, 128 tokens, 3 repeats; each run's
# 8-row lines of table.md are printed, its folder and log left under $1/OUT.
AB=${1:?the folder holding new/ and old/}
M=$(/work/main/.venv/bin/mlxq real-model)
for v in new old; do
  out=$AB/OUT/$v-$(date +%H%M%S)
  (cd /tmp && PYTHONPATH=$AB/$v timeout 1500 /work/main/.venv/bin/python -m mlxq bench --model "$M" --scenario speculative --spec-in-process --spec-rows 8 --spec-drafters ngram,control --spec-workloads grounded,chat --spec-sampling greedy,sampled --spec-new-tokens 128 --repeats 3 --out $out > $out.log 2>&1)
  echo "$v $out:"; grep '| 8 |' $out/table.md
done
