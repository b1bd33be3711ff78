#!/usr/bin/env bash
# The framework checks on the GPU: torch.ops.cupaged (opcheck, results, a compiled step in
# a CUDA graph), the compiled engine, the transformers integration, and the serving tests
# those touch. Logs go to $OUT.   bash tools/torch_check.sh [pytest args...]
source "$(dirname "$0")/device_env.sh"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee "$OUT/torch-info.txt"
TESTS="tests/test_torch_ops.py tests/test_engine.py tests/test_llama.py"
[ -f tests/test_transformers.py ] && TESTS="$TESTS tests/test_transformers.py"
python3 -m pytest -q -p no:cacheprovider $TESTS "$@" 2>&1 | tee "$OUT/torch-tests.txt" | tail -30
status=${PIPESTATUS[0]}
echo "torch check exit status: $status"
exit "$status"
