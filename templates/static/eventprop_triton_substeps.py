# A neuron nonlinear between events has no closed form: its flow over a piece of length h is SUBSTEPS steps of its
# method (epf_step) of length h / SUBSTEPS, and the backward recomputes a piece by the same steps, integrates the
# adjoint by RK4 in reverse time on it (epf_adjoint_rate: (df/dx)^T lambda) and the parameter integrals by
# Simpson's rule with lambda at the midpoints by cubic Hermite interpolation: the C kernels' stepped flow and
# backward (static/c_eventprop.h), in their order of operations. No |A| (no bound, no panels): epf_norm is 0.


@triton.jit
def epf_flow(ep_h, ep_x0, ep_p):
    ep_x = ep_x0
    for ep_k in range(0, SUBSTEPS):
        ep_x = epf_step(ep_h / SUBSTEPS, ep_x, ep_p)
    return ep_x


@triton.jit
def epf_norm(ep_p):
    return tl.zeros([ep_p.shape[0]], tl.float64)


@triton.jit
def eph_stepped_back(ep_x0, ep_lam, ep_dp, ep_length, ep_p, ep_has, ep_nodes):
    """Where `has`: lambda a time `length` earlier, adding the parameter integrals over the piece from x0 on to dp
    (`nodes` 0: no integrals). A substep's start is stepped again from x0 (the same steps give the same values):
    SUBSTEPS (SUBSTEPS + 1) / 2 steps a piece instead of a stored trajectory. Returns lam, dp."""
    ep_hv = ep_length / SUBSTEPS  # a substep's length per lane
    ep_h = ep_hv[:, None]
    ep_acc = tl.zeros_like(ep_dp)
    for ep_back in range(0, SUBSTEPS):
        ep_xc = ep_x0
        for ep_k in range(0, SUBSTEPS - 1 - ep_back):
            ep_xc = epf_step(ep_hv, ep_xc, ep_p)
        ep_xa = epf_step(ep_hv, ep_xc, ep_p)
        ep_xm = epf_step(ep_hv / 2, ep_xc, ep_p)
        ep_k1 = epf_adjoint_rate(ep_xa, ep_lam, ep_p)
        ep_k2 = epf_adjoint_rate(ep_xm, ep_lam + 0.5 * ep_h * ep_k1, ep_p)
        ep_k3 = epf_adjoint_rate(ep_xm, ep_lam + 0.5 * ep_h * ep_k2, ep_p)
        ep_k4 = epf_adjoint_rate(ep_xc, ep_lam + 1.0 * ep_h * ep_k3, ep_p)
        ep_before = ep_lam + ep_h / 6 * (ep_k1 + 2 * ep_k2 + 2 * ep_k3 + ep_k4)
        if ep_nodes > 0:
            ep_slope = epf_adjoint_rate(ep_xc, ep_before, ep_p)
            ep_mid = (ep_lam + ep_before) / 2 + ep_h / 8 * (ep_k1 - ep_slope)
            ep_ta = epf_integrand(ep_xa, ep_lam, ep_p)
            ep_tb = epf_integrand(ep_xm, ep_mid, ep_p)
            ep_tc = epf_integrand(ep_xc, ep_before, ep_p)
            ep_acc += ep_h / 6 * (ep_ta + 4 * ep_tb + ep_tc)
        ep_lam = tl.where(ep_has[:, None], ep_before, ep_lam)
    ep_dp = tl.where(ep_has[:, None], ep_dp + ep_acc, ep_dp)  # (acc stays 0 without nodes)
    return ep_lam, ep_dp
