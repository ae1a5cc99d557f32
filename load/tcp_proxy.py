#!/usr/bin/env python3
"""A loopback TCP proxy that can be cut: `tcp_proxy.py LISTEN_PORT TARGET_HOST TARGET_PORT`.

SIGUSR1 cuts it (every connection dropped, new ones closed at once), SIGUSR2 heals it.
load/chaos puts it in front of Postgres to stage an outage.
"""
import asyncio
import signal
import sys


async def main(listen_port: int, host: str, port: int) -> None:
    state = {"up": True, "conns": set()}

    async def pipe(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def handle(client_reader, client_writer):
        if not state["up"]:
            client_writer.close()
            return
        try:
            server_reader, server_writer = await asyncio.open_connection(host, port)
        except OSError:
            client_writer.close()
            return
        tasks = {
            asyncio.create_task(pipe(client_reader, server_writer)),
            asyncio.create_task(pipe(server_reader, client_writer)),
        }
        state["conns"] |= tasks
        await asyncio.gather(*tasks, return_exceptions=True)
        state["conns"] -= tasks

    def cut():
        state["up"] = False
        for task in list(state["conns"]):
            task.cancel()

    def heal():
        state["up"] = True

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, cut)
    loop.add_signal_handler(signal.SIGUSR2, heal)
    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3])))
