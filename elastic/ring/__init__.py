"""The ring: the native core's one owner, and what a ring carries.

``Communicator`` forms a ring for one world version and runs the collectives on it; ``errors``
says what a failed collective means (and maps the core's failures onto those classes); ``ops``
names the reductions; ``serialization`` is the format objects travel in, which calls nothing a
peer names. This is the lowest layer of ``elastic``: it imports no other part of it, and no other
module imports the compiled core (``elastic.ring._native``) directly.
"""
