# Core unit tests that also run in the sanitizer build.
set_tests_properties(test_sampler test_textstream test_model test_sched test_graph_replay PROPERTIES LABELS asan)
# The scheduler on the default model (batched == alone, 512-token prefix
# reuse, KV pressure).
if(TARGET test_sched_model)
  set_tests_properties(test_sched_model PROPERTIES
    TIMEOUT 300
    LABELS "model"
    REQUIRED_FILES "${FEDINFER_DEFAULT_MODEL}")
endif()
# fedinfer run's sampling flags: OpenAI's penalties change a greedy answer;
# out of range they are refused (exit 2) naming the flag.
if(TARGET fedinfer)
  add_test(NAME cli_run_penalties COMMAND sh -c
    "m='${FEDINFER_DEFAULT_MODEL}'; f='$<TARGET_FILE:fedinfer>'
     a=$($f run -m \"$m\" -t 1 --raw -n 10 --temp 0 '1, 2, 3,') || exit 1
     b=$($f run -m \"$m\" -t 1 --raw -n 10 --temp 0 --frequency-penalty 2 --presence-penalty 2 '1, 2, 3,') || exit 1
     test -n \"$a\" && test \"$a\" != \"$b\" || { echo \"same answer: $a\"; exit 1; }
     $f run -m \"$m\" --presence-penalty 3 x 2>err.txt; test $? = 2 && grep -q -- --presence-penalty err.txt")
  set_tests_properties(cli_run_penalties PROPERTIES LABELS "model" REQUIRED_FILES "${FEDINFER_DEFAULT_MODEL}")
endif()
# fedinfer run refuses a prompt it would otherwise answer with part of it
# silently gone (exit 2, naming what): a NUL byte on stdin (the prompt
# ended there), bytes the vocabulary cannot encode in chat mode (left out,
# as if the user had sent less) and in the --system text.
if(TARGET fedinfer)
  add_test(NAME cli_run_bad_prompt COMMAND sh -c
    "m='${FEDINFER_DEFAULT_MODEL}'; f='$<TARGET_FILE:fedinfer>'
     printf 'Say hello\\000 and then' | $f run -m \"$m\" -t 1 -n 1 - 2>err.txt; test $? = 2 && grep -q 'NUL byte at offset 9' err.txt || exit 1
     $f run -m \"$m\" -t 1 -n 1 \"$(printf '\\377\\376')\" 2>err.txt; test $? = 2 && grep -q 'prompt has bytes' err.txt || exit 1
     $f run -m \"$m\" -t 1 -n 1 --system \"$(printf 'be brief\\004')\" hi 2>err.txt; test $? = 2 && grep -q 'system text has bytes' err.txt || exit 1
     printf 'Say hello' | $f run -m \"$m\" -t 1 -n 1 - >/dev/null")
  set_tests_properties(cli_run_bad_prompt PROPERTIES LABELS "model" REQUIRED_FILES "${FEDINFER_DEFAULT_MODEL}")
endif()
# bench --serve's routing figures come from the coordinator's own router
# (fi_route_pick, given by the fedinfer binary): its hit rate on the
# bench's sequential workload beats round-robin's, with current filters and
# with filters a heartbeat old (the hit rates are deterministic; the times
# are not checked). On that workload each document has its own tie key, so
# the tie-break alone does as well. The second workload (a system prompt
# shared by all, so one tie key, and 4 requests in flight) shows the
# filters' own part: with them the router beats itself without them.
if(TARGET fedinfer)
  add_test(NAME bench_serve_routing COMMAND sh -c
    "out=$('$<TARGET_FILE:fedinfer>' bench --serve -m '${FEDINFER_DEFAULT_MODEL}' -t 1 --only routing) || exit 1
     echo \"$out\"
     rate() { echo \"$out\" | awk -v k=\"$1\" -v n=\"$2\" 'index($0, k) && ++seen == n { for (i = 1; i < NF; i++) if ($i == \"rate\") print $(i + 1) }'; }
     cur=$(rate 'router, filters current' 1); old=$(rate 'router, filters every 40' 1); rr=$(rate 'round-robin  ' 1)
     cur2=$(rate 'router, filters current' 2); nf2=$(rate 'router, no filters' 2); rr2=$(rate 'round-robin  ' 2)
     echo \"hit rates: current $cur, every 40 $old, round-robin $rr; shared system prompt: current $cur2, no filters $nf2, round-robin $rr2\"
     awk -v c=\"$cur\" -v o=\"$old\" -v r=\"$rr\" -v c2=\"$cur2\" -v n2=\"$nf2\" -v r2=\"$rr2\" 'BEGIN { num = \"^[0-9.]+$\"; exit !(c ~ num && o ~ num && r ~ num && c2 ~ num && n2 ~ num && r2 ~ num && c + 0 > r + 0 && o + 0 > r + 0 && c2 + 0 > n2 + 0 && c2 + 0 > r2 + 0) }'")
  set_tests_properties(bench_serve_routing PROPERTIES LABELS "model" REQUIRED_FILES "${FEDINFER_DEFAULT_MODEL}")
endif()
# The 8-bit KV cache from the command line: run answers with it; a
# precision other than 8 or 16 is refused (exit 2) naming the flag; CUDA
# with it is refused naming the reason, before any device is opened.
if(TARGET fedinfer)
  add_test(NAME cli_kv_bits COMMAND sh -c
    "m='${FEDINFER_DEFAULT_MODEL}'; f='$<TARGET_FILE:fedinfer>'
     a=$($f run -m \"$m\" -t 1 --raw -n 10 --temp 0 --kv-bits 8 '1, 2, 3,') || exit 1
     test -n \"$a\" || { echo 'no answer'; exit 1; }
     $f run -m \"$m\" --kv-bits 12 x 2>err.txt; test $? = 2 && grep -q -- --kv-bits err.txt || exit 1
     $f bench --serve -m \"$m\" --kv-bits 4 2>err.txt; test $? = 2 && grep -q -- --kv-bits err.txt || exit 1
     $f run -m \"$m\" --device cuda --kv-bits 8 x 2>err.txt; test $? != 0 && grep -q 'for the CPU backend only' err.txt")
  set_tests_properties(cli_kv_bits PROPERTIES LABELS "model" REQUIRED_FILES "${FEDINFER_DEFAULT_MODEL}")
endif()
# bench --serve's concurrency rows: with 1 first in the list, each ratio
# line and, for the CPU, one stream's decode against the DRAM floor
# measured in the same run (a fraction above 0: a floor was measured and
# the stream decoded; no bound above, as a cached model can pass the floor);
# and, with the AVX2 kernels or the AVX512-VNNI ones (without the AMX tile
# unit), the largest concurrency's decode-only steps against the products'
# compute ceiling probed in the same run, in the kernels' instructions:
# over the default model's 134.5 M multiply-adds a token
# (fi_model_macs_per_token), a fraction strictly between 0 and 1 (two
# streams are far from it); other kernels say the ceiling was not probed.
if(TARGET fedinfer)
  add_test(NAME bench_serve_floor COMMAND sh -c
    "out=$('$<TARGET_FILE:fedinfer>' bench --serve -m '${FEDINFER_DEFAULT_MODEL}' -t 1 --only concurrency --concurrency 1,2 --prompt-tokens 8 --gen-tokens 4) || exit 1
     echo \"$out\"
     echo \"$out\" | grep -q 'concurrency 2: [0-9.]*x the aggregate throughput of concurrency 1' || exit 1
     f=$(echo \"$out\" | awk '/of the DRAM floor/ { for (i = 1; i < NF; i++) if ($(i + 1) == \"of\" && $(i + 2) == \"the\" && $(i + 3) == \"DRAM\") print $i }')
     awk -v f=\"$f\" 'BEGIN { exit !(f ~ /^[0-9.]+$/ && f + 0 > 0) }' || exit 1
     mix=
     echo \"$out\" | grep -q '^backend .* simd avx2,' && mix=vpmaddwd+vpaddd
     echo \"$out\" | grep -q '^backend .* simd avx512vnni,' && ! grep -q amx_int8 /proc/cpuinfo && mix='vpdpwssd (512-bit)'
     if [ -n \"$mix\" ]; then
       echo \"$out\" | grep -qF \"of $mix by 1 thread, no loads, over 134.5 M multiply-adds a token\" || { echo \"no products ceiling in $mix\"; exit 1; }
       c=$(echo \"$out\" | awk '/of the products. ceiling/ { for (i = 1; i < NF; i++) if ($(i + 1) == \"of\" && $(i + 3) == \"products'\\''\") print $i }')
       awk -v c=\"$c\" 'BEGIN { exit !(c ~ /^[0-9.]+$/ && c + 0 > 0 && c + 0 < 1) }'
     else
       echo \"$out\" | grep -q 'products. ceiling: not probed'
     fi")
  set_tests_properties(bench_serve_floor PROPERTIES LABELS "model" REQUIRED_FILES "${FEDINFER_DEFAULT_MODEL}")
endif()
