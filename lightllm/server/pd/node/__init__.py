"""A PD node (``--run_mode prefill|decode``): its control API for the master, metrics, registration."""
