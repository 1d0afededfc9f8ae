"""One tokenspeed prefill rank, run by tests/test_tokenspeed_prefill.py in .venv-tokenspeed:
tokenspeed's own EPD prefill manager and receiver (tokenspeed/runtime/epd/mooncake/
{prefill,receiver}.py) over tokenspeed-mooncake, with receive memory of its own.

argv: rank tp rows hidden. Reads one JSON command per line on stdin, answers one JSON
line on stdout:
  {"op": "room", "bootstrap": "H:P", "room": R, "span": S, "at": ROW, "identity": bool}
      a receiver for room R (tokenspeed's bootstrap handshake), then its pre_alloc: this
      rank's shard of S rows (tokenspeed's shard_rows) or, identity, all of them, written
      at row ROW of the receive memory. -> {"status": N}
  {"op": "wait", "room": R, "timeout": T} -> {"status": N, "rows": hex of the shard's bytes}
"""
import json
import os
import sys
import time

import numpy as np

from tokenspeed.runtime.epd.entities import EmbeddingArgs, EmbeddingManagerArgs
from tokenspeed.runtime.epd.mooncake.prefill import MooncakeEmbeddingManagerPrefill
from tokenspeed.runtime.epd.mooncake.receiver import MooncakeEmbeddingReceiver
from tokenspeed.runtime.pd.base.status import TransferPoll


def shard_rows(span: int, shard_rank: int, shard_size: int) -> tuple[int, int]:
    """tokenspeed's epd/prefill_admission.shard_rows (that module imports the whole engine)."""
    base, rem = divmod(span, shard_size)
    return shard_rank * base + min(shard_rank, rem), base + (1 if shard_rank < rem else 0)


def main() -> None:
    rank, tp, rows, hidden = (int(a) for a in sys.argv[1:5])
    memory = np.full((rows, hidden), 0xDEAD, dtype=np.uint16)  # bfloat16 bits; untouched rows keep this
    row_bytes = hidden * 2
    base = memory.ctypes.data
    mgr = MooncakeEmbeddingManagerPrefill(
        EmbeddingManagerArgs(bootstrap_port=0, tp_size=tp),
        EmbeddingArgs(engine_rank=rank, gpu_id=0, ib_device=None, embedding_data_ptr=base,
                      embedding_data_len=memory.nbytes))
    receivers, shards = {}, {}
    print(json.dumps({"ready": mgr.get_session_id()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        room = cmd["room"]
        if cmd["op"] == "room":
            rx = MooncakeEmbeddingReceiver(mgr, cmd["bootstrap"], room)
            receivers[room] = rx
            span = cmd["span"]
            start, n = (0, span) if cmd.get("identity") else shard_rows(span, rank % tp, tp)
            at = cmd["at"] + (0 if cmd.get("identity") else start)
            shards[room] = (at, n)
            if rx.poll() != TransferPoll.Failed:
                rx.pre_alloc(dst_embedding_ptr=base + at * row_bytes, n_tokens=n, hidden=hidden,
                             dtype="torch.bfloat16", row_start=start, span=span)
            print(json.dumps({"status": int(rx.poll())}), flush=True)
        elif cmd["op"] == "wait":
            rx = receivers[room]
            end = time.monotonic() + cmd["timeout"]
            while rx.poll() not in (TransferPoll.Success, TransferPoll.Failed) and time.monotonic() < end:
                time.sleep(0.005)
            at, n = shards[room]
            print(json.dumps({"status": int(rx.poll()), "rows": memory[at:at + n].tobytes().hex()}), flush=True)
    os._exit(0)  # Mooncake's threads: nothing more to flush


if __name__ == "__main__":
    main()
