"""Pure torch math for FlowGRPO: no Ray, no I/O. Every function is unit-tested on small tensors."""
