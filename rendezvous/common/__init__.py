"""What both sides of the rendezvous use and neither owns: files the tools write, the channel to a
server (addresses, TLS, tokens), text a peer chose made safe, the event log, `/metrics` over
HTTP, port checks. The lowest layer of ``rendezvous``: imports nothing else of it.
"""
