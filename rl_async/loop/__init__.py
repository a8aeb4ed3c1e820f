"""The Ray-free loop: the controller (collect, train, publish, evaluate, checkpoint), the
producer pool, the completed-group buffer, the prompt ledger, the publication state machine,
the fault policies and the event-loop monitor.

Imports: every room below it (`base` .. `engine`) but never `train`, `sim`, the actors or
Ray: the trainer and the fleet reach it through the `Fleet` interface.
"""
