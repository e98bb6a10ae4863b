"""The server side of the node-to-node API (``/internal``), mirroring its client file for
file: :mod:`.link_probe` answers the probe of :mod:`shardline.node.link_probe`, and
:mod:`.transfer` the copies of :mod:`shardline.node.transfer`. Every ``/internal`` request
is signed (:class:`shardline.api.http_guard.SignatureMiddleware`)."""
