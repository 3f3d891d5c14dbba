"""The clients of the rendezvous service: a worker's (``worker_client``: join, follow its worlds,
report, leave; ``watch_events``: what its Watch stream says, as typed values) and a watcher's
(``status_client`` and the table ``status_view`` prints). Imports the wire and the common
layer; never the server.
"""
