# /tmp/ab2/old holds `git archive 4069371 worker mlxq schemas producer`, /tmp/ab2/new the same of f967d03 (the code of 111c835).
M=$(/work/main/.venv/bin/mlxq real-model)
for v in new old; do
  out=/tmp/ab2/OUT/$v-$(date +%H%M%S)
  (cd /tmp && PYTHONPATH=/tmp/ab2/$v timeout 1200 /work/main/.venv/bin/python -m mlxq bench --model "$M" --scenario speculative --spec-in-process --spec-rows 8 --spec-drafters ngram,control --spec-workloads chat --spec-sampling greedy,sampled --spec-new-tokens 128 --repeats 3 --out $out > $out.log 2>&1)
  echo "$v $out:"; grep '| 8 |' $out/table.md
done
