#!/usr/bin/env bash
cd /tmp/clean2
yes > /dev/null & b1=$!
yes > /dev/null & b2=$!
echo "\$ yes > /dev/null & yes > /dev/null &   # pids $b1 $b2"
echo "\$ date -u; git -C /tmp/clean2 log --oneline -1"; date -u; git log --oneline -1
echo "\$ time bash scripts/test.sh -q --durations=12"
( time bash scripts/test.sh -q --durations=12 ) 2>&1
echo "(exit code of test.sh above: see 'passed/failed' line)"
echo "\$ ps -o pid,pcpu,args -p $b1,$b2"; ps -o pid,pcpu,args -p $b1,$b2
kill $b1 $b2
echo "\$ date -u"; date -u
