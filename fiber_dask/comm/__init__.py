"""The transport and the remote objects: framed channels, the authenticated
gate every listener stands behind, TLS, and the object servers and proxies
that queues, locks and managers are made of (as distributed has
``distributed/comm``)."""
