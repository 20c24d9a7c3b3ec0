M=$(/work/main/.venv/bin/mlxq real-model)
for v in head new head new; do
  src=/work/main; [ $v = head ] && src=/work/main/.head
  out=/tmp/ab2-$v-$(date +%H%M%S)
  (cd /tmp && PYTHONPATH=$src timeout 1200 /work/main/.venv/bin/python -m mlxq bench --model "$M" --scenario speculative --spec-in-process --spec-rows 1,8 --spec-drafters ngram,control --spec-workloads grounded --spec-sampling greedy --spec-new-tokens 128 --repeats 3 --out $out > $out.log 2>&1)
  echo "$v $out:"; grep '| grounded | greedy' $out/table.md
done
