"""One process of the multi-process test (tests/distributed/test_multihost.py): process 0 runs the shared
workload over a mesh of both processes' devices and writes its outputs as JSON; process 1 follows.

python -m tests.distributed.multihost_worker PROCESS_ID PORT MODEL OUT [--long]
(--long: process 0 generates for minutes, for the tests that kill a process)
"""

import json
import sys

from jaxpaged.cli import follow_process_zero as follow
from jaxpaged.engine.arg_utils import EngineArgs


def main() -> None:
    process_id, port, model, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    multi = dict(tensor_parallel_size=4, num_processes=2, process_id=process_id,
                 coordinator_address=f"127.0.0.1:{port}")
    if process_id > 0:
        follow(EngineArgs(model=model, max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=14,
                          compile_guard=True, **multi) if "--long" not in sys.argv else
               EngineArgs(model=model, max_num_batched_tokens=32, compile_guard=True, **multi))
        return
    if "--long" in sys.argv:
        from jaxpaged import LLM, SamplingParams

        llm = LLM(model, max_num_batched_tokens=32, compile_guard=True, **multi)
        print("generating", flush=True)
        llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, SamplingParams(max_tokens=400, ignore_eos=True),
                     use_tqdm=False)
        return
    from tests.distributed.workload import run

    with open(out, "w") as f:
        json.dump(run(model, **multi), f)


if __name__ == "__main__":
    main()
