#!/usr/bin/env bash
# Builds a tracing stand-in for the CUDA driver library: every function libcuda exports is
# a trampoline that logs its name (and the calling pid and thread) to standard error, then
# jumps to the real one with every argument untouched. A process that loads "libcuda.so.1"
# or "libcuda.so" from LD_LIBRARY_PATH (cudarc's dynamic loading, as Baton's) gets the shim;
# a process that reaches the driver through cuGetProcAddress (the CUDA runtime: torch,
# CuPy) gets real pointers for those calls, untraced. Issue 46: the driver calls Baton's
# own table does not see (cudarc's context retain, streams, events).
#
# usage (on the GPU machine, which has gcc and nm):
#   bash bench/probe/cuda_trace_shim.sh DIR        # builds DIR/libcuda.so.1 (and .so)
#   LD_LIBRARY_PATH=DIR:$LD_LIBRARY_PATH CUDA_TRACE_SKIP=cuCtxPushCurrent_v2,cuCtxPopCurrent_v2 prog
# CUDA_TRACE_REAL names the real library (default: the libcuda.so.1 ldconfig knows);
# CUDA_TRACE_SKIP lists functions not to log.
set -euo pipefail
dir=${1:?usage: cuda_trace_shim.sh DIR}
mkdir -p "$dir"
real=${CUDA_TRACE_REAL:-$(ldconfig -p | awk '/libcuda\.so\.1 .*x86-64/ {print $NF; exit}')}
[ -n "$real" ] || { echo "no libcuda.so.1 found: set CUDA_TRACE_REAL" >&2; exit 1; }
real=$(readlink -f "$real")
mapfile -t syms < <(nm -D --defined-only "$real" | awk '($2 == "T" || $2 == "W" || $2 == "i") && $3 ~ /^cu[A-Z]/ {sub(/@.*/, "", $3); print $3}' | sort -u)
[ ${#syms[@]} -gt 0 ] || { echo "no cu* functions in $real" >&2; exit 1; }
c="$dir/shim.c"
{
  cat <<HEAD
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <time.h>
#define N ${#syms[@]}
void *baton_trace_real[N];
static const char *names[N] = {
HEAD
  for s in "${syms[@]}"; do echo "  \"$s\","; done
  cat <<'MID'
};
static char skip[N];
static void *lib;

__attribute__((constructor)) static void init(void) {
  const char *path = getenv("CUDA_TRACE_REAL");
MID
  echo "  if (!path) path = \"$real\";"
  cat <<'TAIL'
  lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  if (!lib) { fprintf(stderr, "cuda-trace: %s\n", dlerror()); abort(); }
  const char *sk = getenv("CUDA_TRACE_SKIP");
  for (int i = 0; i < N; i++) {
    baton_trace_real[i] = dlsym(lib, names[i]);
    if (sk) {
      const char *p = strstr(sk, names[i]);
      size_t n = strlen(names[i]);
      while (p) {
        if ((p == sk || p[-1] == ',') && (p[n] == ',' || p[n] == 0)) { skip[i] = 1; break; }
        p = strstr(p + 1, names[i]);
      }
    }
  }
}

/* Called by the common stub with the function's index; returns its real address. */
void *baton_trace_log(long i) {
  if (!skip[i]) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    char line[160];
    int n = snprintf(line, sizeof line, "cuda-trace %ld.%06ld pid=%d tid=%ld %s\n",
                     (long)t.tv_sec, t.tv_nsec / 1000, getpid(), (long)syscall(SYS_gettid),
                     names[i]);
    if (n > 0) { ssize_t w = write(2, line, (size_t)n); (void)w; }
  }
  return baton_trace_real[i];
}

/* Every trampoline puts its index in r11 (a scratch register no argument uses) and jumps
   here: save the argument registers (integer and vector), ask for the real address, put
   them back and jump, so that the real function sees the call as made (stack arguments
   included: everything pushed is popped before the jump). */
__asm__(
  ".text\n.globl baton_trace_common\n.type baton_trace_common,@function\n"
  "baton_trace_common:\n"
  "  push %rdi\n  push %rsi\n  push %rdx\n  push %rcx\n  push %r8\n  push %r9\n  push %rax\n"
  "  push %rbp\n  mov %rsp, %rbp\n  and $-16, %rsp\n  sub $128, %rsp\n"
  "  movdqu %xmm0, 0(%rsp)\n  movdqu %xmm1, 16(%rsp)\n  movdqu %xmm2, 32(%rsp)\n"
  "  movdqu %xmm3, 48(%rsp)\n  movdqu %xmm4, 64(%rsp)\n  movdqu %xmm5, 80(%rsp)\n"
  "  movdqu %xmm6, 96(%rsp)\n  movdqu %xmm7, 112(%rsp)\n"
  "  mov %r11, %rdi\n  call baton_trace_log\n  mov %rax, %r11\n"
  "  movdqu 0(%rsp), %xmm0\n  movdqu 16(%rsp), %xmm1\n  movdqu 32(%rsp), %xmm2\n"
  "  movdqu 48(%rsp), %xmm3\n  movdqu 64(%rsp), %xmm4\n  movdqu 80(%rsp), %xmm5\n"
  "  movdqu 96(%rsp), %xmm6\n  movdqu 112(%rsp), %xmm7\n"
  "  mov %rbp, %rsp\n  pop %rbp\n"
  "  pop %rax\n  pop %r9\n  pop %r8\n  pop %rcx\n  pop %rdx\n  pop %rsi\n  pop %rdi\n"
  "  jmp *%r11\n");
TAIL
  i=0
  for s in "${syms[@]}"; do
    printf '__asm__(".globl %s\\n.type %s,@function\\n%s:\\n  mov $%d, %%r11\\n  jmp baton_trace_common\\n");\n' "$s" "$s" "$s" "$i"
    i=$((i + 1))
  done
} > "$c"
gcc -O1 -shared -fPIC -o "$dir/libcuda.so.1" "$c" -ldl
ln -sf libcuda.so.1 "$dir/libcuda.so"
echo "cuda-trace: $dir/libcuda.so.1 wraps ${#syms[@]} functions of $real" >&2
