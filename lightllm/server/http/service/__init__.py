"""The server's own endpoints beside the APIs: the health probes and vLLM's service endpoints.

``health`` (``/health``, ``/health/live``, ``/health/ready`` and their aliases, and the one place
their answers are computed, which the front door answers from too) and ``service_routes``
(``GET /version`` and ``/ping``).
"""
