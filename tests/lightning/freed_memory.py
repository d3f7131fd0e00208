"""Resident memory a process keeps after freeing 128 MiB of tensors in 2 MiB blocks between 256 KiB ones it keeps.

Run: python tests/lightning/freed_memory.py SET, SET 1 to call ``return_freed_memory()`` first, 0 not to. Prints the
resident bytes gained from before the blocks to after they were freed.
"""

import re
import sys

import torch

from lit_balance.lightning.meters import return_freed_memory


def rss() -> int:
    with open("/proc/self/status") as handle:
        return int(re.search(r"VmRSS:\s+(\d+)", handle.read()).group(1)) * 1024


if __name__ == "__main__":
    if sys.argv[1] == "1" and not return_freed_memory():
        sys.exit("return_freed_memory() made no setting")
    block = torch.ones(2**21)
    del block  # a mapped 8 MiB block, freed: glibc's own threshold rises to 8 MiB
    before = rss()
    freed, kept = [], []
    for _ in range(64):
        freed.append(torch.ones(2**19))  # 2 MiB, written
        kept.append(torch.ones(2**16))  # 256 KiB kept between them: the heap cannot shrink past it
    del freed
    print(rss() - before)
