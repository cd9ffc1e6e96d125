"""Embedding edgespec in a desktop app: generate in a worker, update the UI from its loop.

GUI toolkits (Qt, Tk, wx) want widgets touched only from the UI thread, so the engine's
callbacks put chunks on a queue that the UI loop drains. This example stands in for the
UI loop with a plain `while`, so it runs anywhere:

    python examples/desktop_worker.py
"""

import queue
import time

import edgespec

events: queue.Queue = queue.Queue()

with edgespec.load() as engine:  # the embedded demo bundle; close() frees the sessions
    job = engine.submit("def quicksort(items):", max_new_tokens=200,
                        on_text=lambda chunk: events.put(("text", chunk)),
                        on_done=lambda result: events.put(("done", result)),
                        on_error=lambda error: events.put(("error", error)))
    started = time.time()
    while True:  # the "UI loop"
        kind, payload = events.get()
        if kind == "text":
            print(payload, end="", flush=True)  # e.g. text_edit.insertPlainText(payload)
            if time.time() - started > 5:
                job.cancel()  # e.g. the user pressed Stop
        elif kind == "error":  # e.g. the engine was closed while this job waited
            print(f"\n[error] {payload}")
            break
        else:
            stats = payload.stats
            print(f"\n[{payload.finish_reason}] {stats.new_tokens} tokens, "
                  f"{stats.tokens_per_second:.0f} tok/s, "
                  f"{stats.tokens_per_target_pass:.2f} tokens per target pass")
            break
