# The model as its own draft, served as a worker serves it, on two trees of the code: /tmp/dc/old holds
# `git archive 35854f5 worker mlxq schemas producer` (the draft's calls timed inside its passes), where
# the `draft-self` arm was such a worker; /tmp/dc/new the tree with the draft's calls priced apart,
# where `draft-self` has its pass cost fixed and `draft --spec-draft-model <the model>` is such a
# worker. 1 and 8 rows, both workloads, greedy, 64 tokens, 2 repeats; old, then new.
M=$(/work/main/.venv/bin/mlxq real-model)
for v in old new; do
  arm=draft-self; [ $v = new ] && arm=draft
  (cd /tmp && PYTHONPATH=/tmp/dc/$v timeout 1500 /work/main/.venv/bin/python -m mlxq bench --model "$M" --scenario speculative \
    --spec-in-process --spec-rows 1,8 --spec-drafters $arm,draft-random,control --spec-draft-model "$M" \
    --spec-workloads grounded,chat --spec-sampling greedy --spec-new-tokens 64 --repeats 2 --out /tmp/dc/OUT/$v > /tmp/dc/OUT/$v.log 2>&1)
  echo "$v:"; grep '| [18] |' /tmp/dc/OUT/$v/table.md
done
