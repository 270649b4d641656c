"""The wire: HTTP/1.1 on asyncio protocols, beneath the call path.

`pool.Pool` sends one proxied call to one upstream, at most once, on a keep-alive connection
of its own pool (`connection.Connection`); the request is serialised in `request`, the answer
read by httptools' strict parser in `answer`. What failed, and whether the request may have
left, is told by the type of the error (`errors`).

The layer knows HTTP and sockets, nothing of fences, policies or receipts: the call path
(`gateway.proxy.upstream`) hands it plain values and translates its errors.
"""
