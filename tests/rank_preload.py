"""What tests/forked_ranks.py's forkserver imports once, before it forks any rank.

The modules every rank would otherwise import itself (seconds each: torch, then torch._dynamo,
which torch.optim imports on first use), and the GPT-2 tokenizer the trainer builds at start-up.

Then gc.freeze(): the ~300,000 objects those imports made move to the collector's permanent
generation, which no collection walks. Without it every forked rank pays for a full collection
of them, about 0.2 s (the trainer's teardown runs one, and Python's own full collections come
as a run allocates), and each collection writes to the objects' headers, which copies the
forkserver's pages into the rank. This is what gc.freeze is for: a server that forks workers.
"""

import gc

import numpy  # noqa: F401
import tiktoken  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.checkpoint.state_dict  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.optim  # noqa: F401
import yaml  # noqa: F401

import train_gpt2  # noqa: F401
from data.tokenizer import get_tokenizer

get_tokenizer()  # cached (lru_cache): every rank forked from here has it
gc.freeze()
