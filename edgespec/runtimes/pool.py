"""The thread pools of the process's ONNX Runtime sessions: one each, or one shared.

A target and its draft run one after the other, a pass each, hundreds of times a second.
On pools of their own (ONNX Runtime's default), each pool's workers keep spinning a while
after its run, on the cores the other session's run then needs: on 2 cores a draft's own
2-thread pool doubled the target's pass time, so a small draft runs on one thread, and a
segmented target's sessions must not spin at all. On ONNX Runtime's global pool, shared by
every session, one set of workers serves whichever session runs, and the draft gets them
all: SmolLM2-135M's draft head took 1.13 ms a step within decoding instead of 1.48 (on one
thread of its own), the default mode 1.04x the tokens/s (0.81-1.22 over 12 alternating
rounds of this drifting host, tools/ab_pools.py), AR unchanged.

ONNX Runtime allows the global pool or pools per session in one process, not both: once
the global pool exists, a session asking for a pool of its own fails to load. So sharing
is for a process edgespec owns, and the command line turns it on (`share_threads`); an
application that loads edgespec as a library may too, if the ONNX Runtime sessions it
makes itself take their options from `session_options` (or set
`use_per_session_threads = False`).
"""

from __future__ import annotations

import onnxruntime as ort

_shared = False  # until share_threads()
_sized = False  # the global pool's size is set (by the first session that asked)


def share_threads() -> None:
    """Run every session opened from now on in this process on ONNX Runtime's global
    thread pool; call it before edgespec opens any (the global pool cannot be undone)."""
    global _shared
    _shared = True


def shared() -> bool:
    """Whether sessions share the global pool (drafts and segments then need no care)."""
    return _shared


def session_options(threads: int = 0) -> ort.SessionOptions:
    """Options for a session with `threads` threads of its own (0: one per physical core),
    or, after share_threads(), on the global pool, which the first session sizes with its
    `threads` and later ones join whatever they ask."""
    global _sized
    opts = ort.SessionOptions()
    if not _shared:
        opts.intra_op_num_threads = threads
        return opts
    if not _sized:
        _sized = True
        try:
            ort.set_global_thread_pool_sizes(threads, 1)
        except Exception:  # ORT's own type: the global pool exists already; join it
            pass
    opts.use_per_session_threads = False
    return opts
