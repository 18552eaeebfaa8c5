"""handlers.pools.loop_reader: a pool thread reads an index on the event loop's thread."""

from __future__ import annotations

import asyncio
import threading

from sparsegate.handlers.pools import loop_reader


def test_a_pool_thread_reads_on_the_loop_and_the_loop_reads_directly():
    async def main():
        seen = []
        read = loop_reader(lambda: seen.append(threading.get_ident()) or len(seen))
        assert await asyncio.to_thread(read) == 1  # from a worker thread
        assert read() == 2  # on the loop itself: no hop (it would wait on itself)
        return seen, threading.get_ident()

    seen, loop_thread = asyncio.run(main())
    assert seen == [loop_thread, loop_thread]


def test_an_error_in_the_read_reaches_the_caller():
    async def main():
        read = loop_reader(lambda: {}["missing"])
        try:
            await asyncio.to_thread(read)
        except KeyError:
            return True
        return False

    assert asyncio.run(main())


def test_the_call_arguments_reach_the_read():
    async def main():
        read = loop_reader(lambda key, *, default=None: {"a": 1}.get(key, default))
        return await asyncio.to_thread(read, "a"), await asyncio.to_thread(read, "b", default=2), read("a")

    assert asyncio.run(main()) == (1, 2, 1)
