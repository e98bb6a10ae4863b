"""The server side of the node-to-node API (``/internal``), mirroring its client file for
file: :mod:`.peer_server` answers :class:`shardline.node.peer_client.PeerClient`'s calls,
:mod:`.link_probe` the probe of :mod:`shardline.node.link_probe`, and :mod:`.transfer`
the copies of :mod:`shardline.node.transfer`. The messages are those of
:mod:`shardline.node.wire`; every ``/internal`` request is signed
(:class:`shardline.api.http_guard.SignatureMiddleware`)."""
