"""The serving forward context is per thread: a server stepping its engine in a thread of its own
must not turn a plain forward on another thread into a paged one."""

import threading

from llmlab.model.context import forward_context, get_context


def test_a_context_set_on_one_thread_is_not_seen_on_another():
    inside, seen = threading.Event(), []
    release = threading.Event()

    def engine_thread():
        with forward_context("paged"):
            seen.append(get_context())
            inside.set()
            release.wait(10)
        seen.append(get_context())

    t = threading.Thread(target=engine_thread)
    t.start()
    assert inside.wait(10)
    assert get_context() is None  # the main thread's forward stays plain
    with forward_context("other"):
        assert get_context() == "other"
    release.set()
    t.join(10)
    assert seen == ["paged", None]
    assert get_context() is None
