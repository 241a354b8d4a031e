// "It compiles in C++": the seed's bugs of tests/ui/, written against libtorch. Every case
// below compiles (this file is part of the build), and each one's bug happens at run time.
// `at::Tensor` is a reference-counted handle whose in-place methods are `const` members, so
// neither `const at::Tensor&` nor passing by value keeps a callee from writing into the
// caller's tensor. The one real guard C++ has is a deep copy (`clone()`), the last case.
//
// Each case gets a fresh clone of the inputs and reports whether the bug happened (1) or not
// (0), with one line of what it saw; rust/cpp.rs runs them for tests/cpp_twin.rs and the demo.
#include <cstring>
#include <string>

#include "block.h"

using plusequals::BasicTransformerBlock;

namespace {

using Case = bool (*)(const BasicTransformerBlock&, const at::Tensor&, const at::Tensor&, std::string&);

// tests/ui/mutate_borrowed_input.rs (E0596 in Rust): `const at::Tensor&`, and `add_` compiles.
void attn1_residual(const BasicTransformerBlock& b, const at::Tensor& x) {
  x.add_(b.attn1.forward(b.norm1.forward(x), std::nullopt));
}
bool mutate_borrowed_input(const BasicTransformerBlock& b, const at::Tensor& x0, const at::Tensor&, std::string& what) {
  const at::Tensor x = x0.clone(), before = x0.clone();
  attn1_residual(b, x);
  what = "the caller's const at::Tensor& x was written by add_";
  return !x.equal(before);
}

// tests/ui/use_after_move.rs (E0382): passing by value copies the handle, not the data; the
// caller's skip connection then reads the block's output.
bool use_after_move(const BasicTransformerBlock& b, const at::Tensor& x0, const at::Tensor& c, std::string& what) {
  c10::NoGradGuard no_grad;
  const at::Tensor x = x0.clone(), before = x0.clone();
  const at::Tensor y = b.forward_owned(x, c);  // x passed by value: a second handle
  const at::Tensor skip = x + y;
  what = "x passed by value, read after the call: it holds the block's output";
  return x.equal(y) && !x.equal(before) && skip.defined();
}

// tests/ui/borrow_across_move.rs (E0505): a hook saved the input, then the block wrote into it.
bool borrow_across_move(const BasicTransformerBlock& b, const at::Tensor& x0, const at::Tensor& c, std::string& what) {
  c10::NoGradGuard no_grad;
  at::Tensor x = x0.clone();
  const at::Tensor& saved = x;  // also: const at::Tensor saved = x;
  const at::Tensor before = x.clone();
  b.forward_owned(std::move(x), c);
  what = "std::move(x) into the block; the hook's saved reference reads the output";
  return saved.defined() ? !saved.equal(before) : true;
}

// tests/ui/two_mutable_paths.rs (E0499): two names, one tensor, two writes.
bool two_mutable_paths(const BasicTransformerBlock& b, const at::Tensor& x0, const at::Tensor& c, std::string& what) {
  c10::NoGradGuard no_grad;
  at::Tensor x = x0.clone();
  const at::Tensor a = b.attn1.forward(b.norm1.forward(x), std::nullopt);
  const at::Tensor bb = b.attn2.forward(b.norm2.forward(x), c);
  at::Tensor h = x;  // a second name
  x.add_(a);
  h.add_(bb);
  what = "h = x; x.add_(a); h.add_(b): both writes land in one tensor";
  return x.equal(x0 + a + bb) || x.allclose(x0 + a + bb);
}

// Runs `step` on an activation in the graph (x0 * w, w learnable) with grad on, then backward.
// Returns whether autograd refused ("modified by an inplace operation"), with its message.
template <typename Step>
bool backward_fails(const at::Tensor& x0, Step step, std::string& what) {
  c10::AutoGradMode grad_on(true);
  const at::Tensor w = at::ones({x0.size(-1)}, x0.options()).requires_grad_(true);
  at::Tensor x = x0 * w;
  const at::Tensor y = step(x);
  try {
    y.sum().backward();
  } catch (const c10::Error& e) {
    what = std::string(e.what_without_backtrace()).substr(0, 120);
    return true;
  }
  what = "backward succeeded";
  return false;
}

// tests/ui/borrow_across_inplace_add.rs (E0502): LayerNorm saved x, then x.add_().
bool borrow_across_inplace_add(const BasicTransformerBlock& b, const at::Tensor& x0, const at::Tensor&, std::string& what) {
  return backward_fails(x0, [&](at::Tensor& x) {
    x.add_(b.attn1.forward(b.norm1.forward(x), std::nullopt));
    return x;
  }, what);
}

// tests/ui/inplace_needs_no_grad.rs (E0061): the in-place forward in a training step.
bool inplace_needs_no_grad(const BasicTransformerBlock& b, const at::Tensor& x0, const at::Tensor& c, std::string& what) {
  return backward_fails(x0, [&](at::Tensor& x) { return b.forward_owned(x, c); }, what);
}

// tests/ui/grad_back_on_while_proof_held.rs (E0505): the no-grad scope ended, the in-place
// forward runs anyway (nothing ties it to the guard).
bool grad_back_on_while_proof_held(const BasicTransformerBlock& b, const at::Tensor& x0, const at::Tensor& c,
                                   std::string& what) {
  return backward_fails(x0, [&](at::Tensor& x) {
    { c10::NoGradGuard guard; }  // ended before the call
    return b.forward_owned(x, c);
  }, what);
}

// The real C++ guard: take the tensor by value and clone it before writing.
at::Tensor forward_copy(const BasicTransformerBlock& b, at::Tensor x, const at::Tensor& c) {
  return b.forward_owned(x.clone(), c);
}
bool clone_guard(const BasicTransformerBlock& b, const at::Tensor& x0, const at::Tensor& c, std::string& what) {
  c10::NoGradGuard no_grad;
  const at::Tensor x = x0.clone(), before = x0.clone();
  forward_copy(b, x, c);
  what = "by value + clone(): the caller's x is unchanged (the guard; the bug did not happen)";
  return !x.equal(before);
}

struct Entry {
  const char* name;
  Case run;
};
const Entry CASES[] = {
    {"mutate_borrowed_input", mutate_borrowed_input},
    {"use_after_move", use_after_move},
    {"borrow_across_move", borrow_across_move},
    {"two_mutable_paths", two_mutable_paths},
    {"borrow_across_inplace_add", borrow_across_inplace_add},
    {"inplace_needs_no_grad", inplace_needs_no_grad},
    {"grad_back_on_while_proof_held", grad_back_on_while_proof_held},
    {"clone_guard", clone_guard},
};

}  // namespace

extern "C" {

int64_t pe_cpp_case_count() { return sizeof(CASES) / sizeof(CASES[0]); }

const char* pe_cpp_case_name(int64_t i) { return CASES[i].name; }

// 1: the bug happened; 0: it did not; -1: the case itself failed. `what` gets one line.
int32_t pe_cpp_case_run(int64_t i, const BasicTransformerBlock* block, const at::Tensor* x, const at::Tensor* context,
                        char* what, size_t len) {
  std::string seen;
  int32_t result;
  try {
    result = CASES[i].run(*block, *x, *context, seen) ? 1 : 0;
  } catch (const c10::Error& e) {
    seen = e.what_without_backtrace();
    result = -1;
  } catch (...) {
    seen = "unknown C++ exception";
    result = -1;
  }
  std::strncpy(what, seen.c_str(), len - 1);
  what[len - 1] = '\0';
  return result;
}

}  // extern "C"
