"""The Ray-free loop: the controller (collect, train, publish, evaluate, checkpoint), the
producer pool, the completed-group buffer, the prompt ledger, the publication state machine,
the fault policies and the event-loop monitor.

Imports: `base`, `algo`, `observe`, `plan`, `engine`; never the trainers, the simulator, the
actors or Ray: the trainer and the fleet reach it through the `Fleet` interface.
"""
