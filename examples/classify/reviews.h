// A labelled set of short hotel reviews, generated (nothing is downloaded): the English
// counterpart of the ChnSentiCorp hotel reviews the text-classification walkthrough uses.
// Each review mixes neutral words with one to three opinion words; "not" before an opinion word
// flips it, and some reviews carry an opinion of the other polarity ("… but …"), so a model has
// to read the words in context. Labels: 1 positive, 0 negative.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace classify {

struct Review {
  std::string text;
  int64_t label;
};

// `count` reviews from a fixed seed; the same seed gives the same reviews on every rank.
std::vector<Review> generate_reviews(int64_t count, uint64_t seed);

// Word-level vocabulary over every word generate_reviews can produce: 0 is padding, 1 is the
// [CLS] token that starts every sequence.
class Vocabulary {
 public:
  Vocabulary();
  int64_t size() const { return static_cast<int64_t>(words_.size()); }
  // [CLS] + the text's words, cut or padded with 0 to `length`. Throws on an unknown word.
  std::vector<int64_t> encode(const std::string& text, int64_t length) const;

 private:
  std::vector<std::string> words_;
  std::unordered_map<std::string, int64_t> index_;
};

}  // namespace classify
