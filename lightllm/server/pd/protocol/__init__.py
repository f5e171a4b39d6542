"""The PD contract: what the master and the nodes say to each other.

Both sides import only this package: the node's registration record and compatibility rules
(``node_info``), the node's stream lines (``stream_lines``), the node events they carry
(``node_events``) and the one naming of a PD request's end, from the rank's finish status to
the stream line (``outcomes``), and the membership endpoints with the heartbeat defaults
(``membership``).
"""
