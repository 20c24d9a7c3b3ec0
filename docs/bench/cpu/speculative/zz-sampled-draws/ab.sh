M=$(/work/main/.venv/bin/mlxq real-model)
for v in old new old new; do
  out=/tmp/ab/OUT/$v-$(date +%H%M%S); mkdir -p /tmp/ab/OUT
  (cd /tmp && PYTHONPATH=/tmp/ab/$v (git archive 7f80926 for old, 3fc02cd for new) timeout 1500 /work/main/.venv/bin/python -m mlxq bench --model "$M" --scenario speculative --spec-in-process --spec-rows 8 --spec-drafters ngram,control --spec-workloads grounded,chat --spec-sampling sampled --spec-new-tokens 128 --repeats 3 --out $out > $out.log 2>&1)
  echo "$v $out:"; grep '| sampled | 8' $out/table.md
done
