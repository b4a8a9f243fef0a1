"""What talks to other tools: NIR import and export (`nir`), drop-in conversion of SpikingJelly and snnTorch models
(`conversion`), and the peers' neurons written as flexgen specs (`peers`).
"""
