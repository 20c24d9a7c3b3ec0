# Run from anywhere: /tmp/ab/old holds `git archive 4069371 worker mlxq schemas producer`, /tmp/ab/new the same of 270856f.
bash "$(dirname "$0")/../ab_trees.sh" /tmp/ab
