"""Peak resident memory of one rank reading a stream 20 windows long: printed as JSON (kB) after the first window
and at the end, each from a peak reset after start-up (``/proc/self/clear_refs``).

Run: python tests/stream/stream_memory.py WINDOW_DOCUMENTS NUM_WINDOWS
"""

import json
import sys
from pathlib import Path

import numpy as np

from lit_balance import BatchingSettings
from lit_balance.stream import StreamBatches, StreamCorpus


def _kb(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def main():
    window, windows = int(sys.argv[1]), int(sys.argv[2])

    def documents():
        rng = np.random.default_rng(0)
        for i in range(window * windows):
            yield np.full(int(rng.integers(200, 800)), i % 1000 + 1, dtype=np.int64)

    batches = StreamBatches(StreamCorpus(documents), BatchingSettings(max_tokens=16384), window_documents=window,
                            num_replicas=1, rank=0)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current resident size
    base = _kb("VmRSS")
    first = None
    for k, batch in enumerate(batches):
        if first is None and int(batch["indices"].min()) >= window:  # the second window has begun
            first = _kb("VmHWM")
    print(json.dumps({"base_kb": base, "first_window_peak_kb": first, "end_peak_kb": _kb("VmHWM"),
                      "documents": window * windows, "batches": k + 1}))


if __name__ == "__main__":
    main()
