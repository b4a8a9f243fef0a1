"""What talks to other tools: NIR import and export (`nir`), drop-in conversion of SpikingJelly and snnTorch models
(`conversion`), the peers' neurons written as flexgen specs (`peers`), and models leaving Python (`export`:
torch.export, saved programs, ONNX).
"""
