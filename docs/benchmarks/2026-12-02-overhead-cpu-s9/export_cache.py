"""The HF export's per-layer expert view cache (`HFExporter._local_experts`) against per-expert indexing, alternating
in one process on the real trainer: CPU ms per full export."""

import time

from _trainer import trainer_and_step
from beamrl.trainer.megatron import mapping

trainer, _ = trainer_and_step()
cached = mapping.HFExporter._local_experts


def per_expert(self, named, m, layer, j, inter):
    gu, dn = named[m + "gate_up_weight"].detach(), named[m + "down_weight"].detach()
    return {j: gu[j, :inter]}, {j: gu[j, inter:]}, {j: dn[j]}


times = {"cache": [], "per-expert indexing": []}
for _ in range(40):
    for mode, fn in (("cache", cached), ("per-expert indexing", per_expert)):
        mapping.HFExporter._local_experts = fn
        t = time.thread_time()
        for _unit in trainer.export_hf():
            pass
        times[mode].append(time.thread_time() - t)
for mode, v in times.items():
    print(f"{mode}: export CPU ms min {min(v) * 1e3:.3f} median {sorted(v)[20] * 1e3:.3f}")
trainer.shutdown()
