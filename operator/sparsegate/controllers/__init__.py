"""Controllers: the observe → decide → persist → act loops the Kopf handlers drive.

They sit between the Kopf wiring (``sparsegate.handlers``) and the clients: they use
``sparsegate.clients`` for I/O and ``sparsegate.domain`` for every decision.
"""
