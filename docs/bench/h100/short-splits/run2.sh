#!/usr/bin/env bash
# The tree before the split of K (.base = git archive bb34fc9^) against the working tree
# (split K, the merge reading only the splits that hold keys): batch-1 steps of the
# families not in run1.sh, alternated twice. Usage: OUT=dir bash docs/bench/h100/short-splits/run2.sh
source docs/bench/bench_env.sh
source docs/bench/profile_trees.sh
LIMIT_S=130 profile_trees "$OUT/families.txt" llama3-8b-random:1 gpt-oss-20b-random:1 gemma3-12b-random:1
