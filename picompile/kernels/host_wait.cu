// picompile: the device's wait for a flag the host writes (codegen/cuda.py's wait_value).
//
// Why: in the hybrid decode step the GPU needs each split block's cold output, which the CPU's
// cold worker (kernels/cold_worker.c) writes to pinned host memory and announces by setting the
// block's `done` flag there to the step's serial. Waiting on the device instead of the host
// lets a whole decode step be one CUDA graph: the host neither wakes per block nor launches the
// next segment, and the copies that follow the wait read the output once it is there.
//
// One thread polls the flag through the system-scope acquire load (the host's writes before
// the flag are visible after it); each poll crosses PCIe (about a microsecond), which paces
// the loop. It gives up after `timeout_ns`, setting *gave_up (pinned host memory, which the
// host checks: the step that follows read an output never written). The worker always writes
// `done`, even after an error, so this only bounds a hang. The time is %globaltimer's; in case
// that timer does not tick (it is the driver's to update), the SM's own cycle counter bounds
// the wait too, at 4 cycles a nanosecond: no SM clocks faster, so it never gives up early.
//
// Pointers: flag [1] int32 and gave_up [1] int32 in pinned host memory (unified addressing:
// their host addresses are their device addresses), value [1] int32 on the device (the
// batch's serial, set before a replay).

extern "C" __global__ void __launch_bounds__(1)
pi_wait_value(const int* flag, const int* value, int* gave_up, unsigned long long timeout_ns) {
    const int want = *value;
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    const long long cycles0 = clock64();
    for (;;) {
        int seen;
        asm volatile("ld.acquire.sys.b32 %0, [%1];" : "=r"(seen) : "l"(flag) : "memory");
        if (seen == want)
            return;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > timeout_ns
            || (unsigned long long)(clock64() - cycles0) > 4ull * timeout_ns) {
            asm volatile("st.release.sys.b32 [%0], %1;" :: "l"(gave_up), "r"(1) : "memory");
            return;
        }
    }
}
