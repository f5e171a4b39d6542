"""The PD contract: what the master and the nodes say to each other.

Both sides import only this package: the node's registration record and compatibility rules
(``node_info``), the one ``host:port`` rule of the addresses it carries (``host_port``), the node's request bodies and stream lines (``stream_lines``: the master builds
the bodies and reads the lines only through it), the node events the lines carry
(``node_events``) and the one naming of a PD request's end, from the rank's finish status to
the stream line (``outcomes``), and the membership endpoints with the heartbeat defaults
(``membership``).
"""
