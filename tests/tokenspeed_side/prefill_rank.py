"""tokenspeed prefill ranks, run by tests/integrations/test_tokenspeed_prefill.py in .venv-tokenspeed:
each tokenspeed's own EPD prefill manager and receiver (tokenspeed/runtime/epd/mooncake/
{prefill,receiver}.py) over a tokenspeed-mooncake engine of its own, with receive memory
of its own. Several in one process, as tokenspeed's import takes seconds of CPU.

argv: ranks rows hidden, ranks as RANK:TP,RANK:TP,... Reads one JSON command per line on
stdin, answers one JSON line on stdout; "who" is a rank's index in argv's list:
  {"op": "room", "who": I, "bootstrap": "H:P", "room": R, "span": S, "at": ROW, "identity": bool}
      a receiver for room R (tokenspeed's bootstrap handshake), then its pre_alloc: this
      rank's shard of S rows (tokenspeed's shard_rows) or, identity, all of them, written
      at row ROW of its receive memory. -> {"status": N}
  {"op": "wait", "who": I, "room": R, "timeout": T} -> {"status": N, "rows": hex of the shard's bytes}
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


class PrefillRank:
    def __init__(self, rank: int, tp: int, rows: int, hidden: int):
        self.rank, self.tp, self.hidden = rank, tp, hidden
        self.memory = np.full((rows, hidden), 0xDEAD, dtype=np.uint16)  # bfloat16 bits; untouched rows keep this
        self.mgr = MooncakeEmbeddingManagerPrefill(
            EmbeddingManagerArgs(bootstrap_port=0, tp_size=tp),
            EmbeddingArgs(engine_rank=rank, gpu_id=0, ib_device=None, embedding_data_ptr=self.memory.ctypes.data,
                          embedding_data_len=self.memory.nbytes))
        self.receivers, self.shards = {}, {}

    def room(self, cmd: dict) -> dict:
        room, span = cmd["room"], cmd["span"]
        rx = self.receivers[room] = MooncakeEmbeddingReceiver(self.mgr, cmd["bootstrap"], room)
        start, n = (0, span) if cmd.get("identity") else shard_rows(span, self.rank % self.tp, self.tp)
        at = cmd["at"] + (0 if cmd.get("identity") else start)
        self.shards[room] = (at, n)
        if rx.poll() != TransferPoll.Failed:
            rx.pre_alloc(dst_embedding_ptr=self.memory.ctypes.data + at * self.hidden * 2, n_tokens=n,
                         hidden=self.hidden, dtype="torch.bfloat16", row_start=start, span=span)
        return {"status": int(rx.poll())}

    def wait(self, cmd: dict) -> dict:
        rx = self.receivers[cmd["room"]]
        end = time.monotonic() + cmd["timeout"]
        while rx.poll() not in (TransferPoll.Success, TransferPoll.Failed) and time.monotonic() < end:
            time.sleep(0.005)
        at, n = self.shards[cmd["room"]]
        return {"status": int(rx.poll()), "rows": self.memory[at:at + n].tobytes().hex()}


def main() -> None:
    rows, hidden = int(sys.argv[2]), int(sys.argv[3])
    ranks = [PrefillRank(*(int(x) for x in spec.split(":")), rows, hidden) for spec in sys.argv[1].split(",")]
    print(json.dumps({"ready": [r.mgr.get_session_id() for r in ranks]}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        rank = ranks[cmd["who"]]
        print(json.dumps(rank.room(cmd) if cmd["op"] == "room" else rank.wait(cmd)), flush=True)
    os._exit(0)  # Mooncake's threads: nothing more to flush


if __name__ == "__main__":
    main()
