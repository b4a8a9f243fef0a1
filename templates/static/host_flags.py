@triton.jit
def ps_poll(ps_ptr):
    """The host's word at ps_ptr (pinned host memory), fetched again every call, with acquire at system scope."""
    return tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ps_ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def ps_publish(ps_ptr, ps_value):
    """Writes ps_value to the host's word at ps_ptr with release at system scope: the host that reads it sees
    every write this thread saw before."""
    return tl.inline_asm_elementwise("st.release.sys.global.b32 [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                     [ps_ptr, ps_value], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def ps_clock():
    """The GPU's global timer, in nanoseconds."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def ps_arrive(ps_counter):
    """This program has done its part: every thread's stores before one thread counts the arrival."""
    tl.debug_barrier()
    tl.atomic_add(ps_counter, 1, sem="release", scope="sys")


@triton.jit
def ps_wait(ps_counter, ps_target):
    """Until ps_counter counts ps_target arrivals; every thread's loads after come after that acquire."""
    while tl.atomic_add(ps_counter, 0, sem="acquire") < ps_target:
        pass
    tl.debug_barrier()


@triton.jit
def ps_copy(ps_from, ps_to, ps_n, ps_program, ps_programs, PS_BLOCK: tl.constexpr):
    """The program's share of ps_n elements from the host's memory at ps_from to ps_to: its blocks of PS_BLOCK,
    every ps_programs-th. The loads fetch again (never a line cached from an earlier step)."""
    for ps_at in range(ps_program * PS_BLOCK, ps_n, ps_programs * PS_BLOCK):
        ps_offs = ps_at + tl.arange(0, PS_BLOCK)
        ps_values = tl.load(ps_from + ps_offs, mask=ps_offs < ps_n, cache_modifier=".cv")
        tl.store(ps_to + ps_offs, ps_values, mask=ps_offs < ps_n)
